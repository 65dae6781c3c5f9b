# rules for preference tuning: clean preference pairs, score them once with the frozen chat model, then DPO.
# The DPO run directory ({RESULTS}/dpo/) is not a declared output, like pretraining's and SFT's, so a re-run
# after a crash resumes from its newest checkpoint. `snakemake results/dpo.bin` runs these; with
# eval.dpo: true, `evaluate` also reports the DPO model and so pulls them into a plain run.
from nanoeuler.data import prefs as _prefs

if config["eval"]["dpo"]:  # HellaSwag scores the DPO model too, and `evaluate` reports it
    EVAL_MODELS.append("dpo")


rule prefs:
    input:
        local_sources(_prefs.sources(config["prefs"]), workflow.basedir),
    output:
        "data/prefs/prefs.jsonl",
    params:
        cfg=stage_params("prefs"),
        raw="data/prefs/raw",
        root=source_root,
    log:
        "logs/prefs.log",
    benchmark:
        "benchmarks/prefs.tsv"
    shell:
        "nanoeuler prefs --params {params.cfg:q} --raw-dir {params.raw:q} "
        "--source-root {params.root:q} --out {output:q} > {log:q} 2>&1"


rule ref_logps:
    input:
        chat=f"{RESULTS}/chat.bin",
        prefs="data/prefs/prefs.jsonl",
    output:
        f"{RESULTS}/ref_logps.npz",
    params:
        cfg=stage_params("device", "gpu_memory"),
    threads: RES["cpu_threads"]
    resources:
        **job_resources(gpu=config["device"] != "cpu"),
    log:
        f"{LOGS}/ref_logps.log",
    benchmark:
        f"{BENCH}/ref_logps.tsv"
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} "
        "nanoeuler ref-logps --params {params.cfg:q} --ckpt {input.chat:q} --prefs {input.prefs:q} "
        "--out {output:q} > {log:q} 2>&1"


rule dpo:
    input:
        chat=f"{RESULTS}/chat.bin",
        prefs="data/prefs/prefs.jsonl",
        ref=f"{RESULTS}/ref_logps.npz",
    output:
        f"{RESULTS}/dpo.bin",
    params:
        cfg=stage_params("device", "gpu_memory", "dpo"),
        run_dir=f"{RESULTS}/dpo",
    threads: RES["cpu_threads"]
    resources:
        **job_resources(gpu=config["device"] != "cpu"),
    log:
        f"{LOGS}/dpo.log",
    benchmark:
        f"{BENCH}/dpo.tsv"
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} "
        "nanoeuler dpo --params {params.cfg:q} --ckpt {input.chat:q} --prefs {input.prefs:q} --ref {input.ref:q} "
        "--out {output:q} --run-dir {params.run_dir:q} > {log:q} 2>&1"
