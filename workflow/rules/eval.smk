# rules for the eval stages: HellaSwag scores, samples, validation metrics of the models, the loss plot,
# and the pages of the Snakemake report (snakemake --report report.html). Outputs marked report() appear
# in the report under their category, with the caption in workflow/report/.


rule hellaswag_eval:
    input:
        model=f"{RESULTS}/{{model}}.bin",
        data="data/hellaswag/hellaswag.jsonl",
    output:
        f"{RESULTS}/hellaswag/{{model}}.json",
    wildcard_constraints:
        model="[A-Za-z0-9_]+",
    params:
        cfg=stage_params("device", "gpu_memory", "eval"),
    threads: RES["cpu_threads"]
    resources:
        **job_resources(gpu=config["device"] != "cpu"),
    log:
        f"{LOGS}/hellaswag_eval_{{model}}.log",
    benchmark:
        f"{BENCH}/hellaswag_eval_{{model}}.tsv"
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} "
        "nanoeuler hellaswag-eval --params {params.cfg:q} --ckpt {input.model:q} --data {input.data:q} "
        "--name {wildcards.model} --out {output:q} > {log:q} 2>&1"


rule evaluate:
    input:
        base=f"{RESULTS}/base.bin",
        chat=f"{RESULTS}/chat.bin",
        shards=f"{RESULTS}/shards/manifest.json",
        hellaswag=lambda wildcards: [f"{RESULTS}/hellaswag/{m}.json" for m in EVAL_MODELS],
        dpo=[f"{RESULTS}/dpo.bin"] if config["eval"]["dpo"] else [],
    output:
        samples=f"{RESULTS}/samples.md",
        metrics=f"{RESULTS}/metrics.json",
        plot=report(f"{RESULTS}/loss.png", caption="../report/loss.rst", category="Loss curves"),
    params:
        cfg=stage_params("device", "gpu_memory", "eval"),
        pretrain_dir=f"{RESULTS}/pretrain",
        sft_dir=f"{RESULTS}/sft",
        dpo=f"--dpo {RESULTS}/dpo.bin" if config["eval"]["dpo"] else "",
    threads: RES["cpu_threads"]
    resources:
        **job_resources(gpu=config["device"] != "cpu"),
    log:
        f"{LOGS}/evaluate.log",
    benchmark:
        f"{BENCH}/evaluate.tsv"
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} "
        "nanoeuler evaluate --params {params.cfg:q} --base {input.base:q} --chat {input.chat:q} "
        "--shards {input.shards:q} --samples {output.samples:q} --metrics {output.metrics:q} "
        "--plot {output.plot:q} {params.dpo} --hellaswag {input.hellaswag:q} --pretrain-dir {params.pretrain_dir:q} "
        "--sft-dir {params.sft_dir:q} > {log:q} 2>&1"


rule report_pages:
    input:
        metrics=f"{RESULTS}/metrics.json",
        samples=f"{RESULTS}/samples.md",
    output:
        metrics=report(f"{RESULTS}/report/metrics.html", caption="../report/metrics.rst", category="Metrics"),
        hellaswag=report(f"{RESULTS}/report/hellaswag.html", caption="../report/hellaswag.rst", category="HellaSwag"),
        samples=report(f"{RESULTS}/report/samples.html", caption="../report/samples.rst", category="Samples"),
        config=report(f"{RESULTS}/report/config.html", caption="../report/config.rst", category="Config"),
    params:
        run_config=lambda wildcards: json.dumps(config, sort_keys=True),
    log:
        f"{LOGS}/report_pages.log",
    shell:
        "nanoeuler report-pages --metrics {input.metrics:q} --samples {input.samples:q} "
        "--run-config {params.run_config:q} --out-dir $(dirname {output.metrics:q}) > {log:q} 2>&1"


rule compare:
    input:
        metrics=[f"{experiment_dirs(name)[0]}/metrics.json" for name in config["compare"]["experiments"]],
    output:
        table=report(f"{RESULTS}/compare/metrics.html", caption="../report/compare.rst", category="Experiments"),
        plot=report(f"{RESULTS}/compare/loss.png", caption="../report/compare.rst", category="Experiments"),
    params:
        names=config["compare"]["experiments"],
    log:
        f"{LOGS}/compare.log",
    shell:
        "nanoeuler compare {params.names:q} --table {output.table:q} --plot {output.plot:q} > {log:q} 2>&1"

