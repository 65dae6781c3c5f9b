# rules for preference tuning: clean preference pairs, score them once with the frozen chat model, then DPO.
# The DPO run directory (results/dpo/) is not a declared output, like pretraining's and SFT's, so a re-run
# after a crash resumes from its newest checkpoint. `snakemake results/dpo.bin` runs these; with
# eval.dpo: true, `evaluate` also reports the DPO model and so pulls them into a plain run.
from nanoeuler.data import prefs as _prefs


rule prefs:
    input:
        local_sources(_prefs.sources(config["prefs"]), workflow.basedir),
    output:
        "data/prefs/prefs.jsonl",
    params:
        cfg=stage_params("prefs"),
        raw="data/prefs/raw",
        root=lambda wildcards: workflow.basedir,  # resolves relative sample paths; not a file prefix
    log:
        "logs/prefs.log",
    shell:
        "nanoeuler prefs --params {params.cfg:q} --raw-dir {params.raw:q} "
        "--source-root {params.root:q} --out {output:q} > {log:q} 2>&1"


rule ref_logps:
    input:
        chat="results/chat.bin",
        prefs="data/prefs/prefs.jsonl",
    output:
        "results/ref_logps.npz",
    params:
        cfg=stage_params("device"),
    threads: 64
    resources:
        gpu=0 if config["device"] == "cpu" else 1,
    log:
        "logs/ref_logps.log",
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} "
        "nanoeuler ref-logps --params {params.cfg:q} --ckpt {input.chat:q} --prefs {input.prefs:q} "
        "--out {output:q} > {log:q} 2>&1"


rule dpo:
    input:
        chat="results/chat.bin",
        prefs="data/prefs/prefs.jsonl",
        ref="results/ref_logps.npz",
    output:
        "results/dpo.bin",
    params:
        cfg=stage_params("device", "dpo"),
    threads: 64
    resources:
        gpu=0 if config["device"] == "cpu" else 1,
    log:
        "logs/dpo.log",
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} "
        "nanoeuler dpo --params {params.cfg:q} --ckpt {input.chat:q} --prefs {input.prefs:q} --ref {input.ref:q} "
        "--out {output:q} --run-dir results/dpo > {log:q} 2>&1"
