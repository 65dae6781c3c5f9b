# rules for the eval stages: samples, validation metrics of both models, and the loss plot.


rule evaluate:
    input:
        base="results/base.bin",
        chat="results/chat.bin",
        shards="results/shards/manifest.json",
        dpo=["results/dpo.bin"] if config["eval"]["dpo"] else [],
    output:
        samples="results/samples.md",
        metrics="results/metrics.json",
        plot="results/loss.png",
    params:
        cfg=stage_params("device", "eval"),
        dpo="--dpo results/dpo.bin" if config["eval"]["dpo"] else "",
    threads: 64
    resources:
        gpu=0 if config["device"] == "cpu" else 1,
    log:
        "logs/evaluate.log",
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} "
        "nanoeuler evaluate --params {params.cfg:q} --base {input.base:q} --chat {input.chat:q} "
        "--shards {input.shards:q} --samples {output.samples:q} --metrics {output.metrics:q} "
        "--plot {output.plot:q} {params.dpo} --pretrain-dir results/pretrain --sft-dir results/sft > {log:q} 2>&1"
