# rule for the release: a finished run as a folder to share ({RESULTS}/release/: the HF model with its chat
# template, our checkpoint, a model card written from the run's files, SHA256SUMS). It releases the DPO model
# when the run makes one (eval.dpo), else the chat model. The declared output is the checksum list, written
# last: a directory() output would be deleted whole by Snakemake before a re-run, and `nanoeuler release`
# removes only what a release wrote. `snakemake results/release/SHA256SUMS ...` builds it.


rule release:
    input:
        model=f"{RESULTS}/dpo.bin" if config["eval"]["dpo"] else f"{RESULTS}/chat.bin",
        base=f"{RESULTS}/base.bin",
        metrics=f"{RESULTS}/metrics.json",
        samples=f"{RESULTS}/samples.md",
    output:
        f"{RESULTS}/release/SHA256SUMS",
    params:
        cfg=stage_params(*config),  # the card names the data sources, the run_config.yaml holds it all
        pretrain_dir=f"{RESULTS}/pretrain",
        benchmarks=sorted({BENCH, "benchmarks"}),  # an experiment's stages, and the shared data stages
    localrule: True
    log:
        f"{LOGS}/release.log",
    shell:
        "nanoeuler release --params {params.cfg:q} --model {input.model:q} --base {input.base:q} "
        "--metrics {input.metrics:q} --samples {input.samples:q} "
        "--pretrain-dir {params.pretrain_dir:q} --benchmarks {params.benchmarks:q} --out \"$(dirname {output:q})\" "
        "> {log:q} 2>&1"
