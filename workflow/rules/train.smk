# rules for the train stages: pretraining on the token shards, then Alpaca fine-tuning.
# Each stage keeps a run directory ({RESULTS}/pretrain/, {RESULTS}/sft/) with rotating checkpoints and
# metrics.jsonl; it is not a declared output, so Snakemake leaves it alone and a re-run after a crash
# or kill resumes from the newest checkpoint there.


rule pretrain:
    input:
        shards=f"{RESULTS}/shards/manifest.json",
        tok=f"{RESULTS}/tokenizer.json",
    output:
        f"{RESULTS}/base.bin",
    params:
        cfg=stage_params("device", "gpu_memory", "model", "pretrain"),
        run_dir=f"{RESULTS}/pretrain",
    threads: RES["cpu_threads"]  # BLAS threads on the CPU; capped at --cores by Snakemake
    resources:
        **job_resources(gpu=config["device"] != "cpu", count=config["pretrain"]["gpus"]),
    log:
        f"{LOGS}/pretrain.log",
    benchmark:
        f"{BENCH}/pretrain.tsv"
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} "
        "nanoeuler pretrain --params {params.cfg:q} --shards {input.shards:q} --tokenizer {input.tok:q} "
        "--out {output:q} --run-dir {params.run_dir:q} > {log:q} 2>&1"


rule sft:
    input:
        base=f"{RESULTS}/base.bin",
        data="data/alpaca/alpaca.jsonl",
    output:
        f"{RESULTS}/chat.bin",
    params:
        cfg=stage_params("device", "gpu_memory", "sft"),
        run_dir=f"{RESULTS}/sft",
    threads: RES["cpu_threads"]
    resources:
        **job_resources(gpu=config["device"] != "cpu", count=config["sft"]["gpus"]),
    log:
        f"{LOGS}/sft.log",
    benchmark:
        f"{BENCH}/sft.tsv"
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} "
        "nanoeuler sft --params {params.cfg:q} --base {input.base:q} --data {input.data:q} "
        "--out {output:q} --run-dir {params.run_dir:q} > {log:q} 2>&1"
