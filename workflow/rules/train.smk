# rules for the train stages: pretraining on the token shards, then Alpaca fine-tuning.
# Each stage keeps a run directory (results/pretrain/, results/sft/) with rotating checkpoints and
# metrics.jsonl; it is not a declared output, so Snakemake leaves it alone and a re-run after a crash
# or kill resumes from the newest checkpoint there.


rule pretrain:
    input:
        shards="results/shards/manifest.json",
        tok="results/tokenizer.json",
    output:
        "results/base.bin",
    params:
        cfg=stage_params("device", "model", "pretrain"),
    threads: 64  # BLAS threads on the CPU; capped at --cores by Snakemake
    resources:
        gpu=0 if config["device"] == "cpu" else config["pretrain"]["gpus"],
    log:
        "logs/pretrain.log",
    benchmark:
        "benchmarks/pretrain.tsv"
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} "
        "nanoeuler pretrain --params {params.cfg:q} --shards {input.shards:q} --tokenizer {input.tok:q} "
        "--out {output:q} --run-dir results/pretrain > {log:q} 2>&1"


rule sft:
    input:
        base="results/base.bin",
        data="data/alpaca/alpaca.jsonl",
    output:
        "results/chat.bin",
    params:
        cfg=stage_params("device", "sft"),
    threads: 64
    resources:
        gpu=0 if config["device"] == "cpu" else config["sft"]["gpus"],
    log:
        "logs/sft.log",
    benchmark:
        "benchmarks/sft.tsv"
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} "
        "nanoeuler sft --params {params.cfg:q} --base {input.base:q} --data {input.data:q} "
        "--out {output:q} --run-dir results/sft > {log:q} 2>&1"
