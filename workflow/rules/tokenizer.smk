# rules for the tokenizer stages: learn BPE merges on the training corpus, then encode both splits to shards.


rule tokenizer:
    input:
        "data/corpus/train.parquet",
    output:
        tok=f"{RESULTS}/tokenizer.json",
        hf=f"{RESULTS}/tokenizer.hf.json",
    params:
        cfg=stage_params("tokenizer"),
    resources:
        **job_resources(),
    log:
        f"{LOGS}/tokenizer.log",
    benchmark:
        f"{BENCH}/tokenizer.tsv"
    shell:
        "nanoeuler tokenizer --params {params.cfg:q} --corpus {input:q} "
        "--out {output.tok:q} --hf-out {output.hf:q} > {log:q} 2>&1"


rule shards:
    input:
        tok=f"{RESULTS}/tokenizer.json",
        train="data/corpus/train.parquet",
        val="data/corpus/val.parquet",
    output:
        f"{RESULTS}/shards/manifest.json",
    params:
        cfg=stage_params("shards"),
    threads: RES["cpu_threads"]  # capped at --cores by Snakemake
    resources:
        **job_resources(),
    log:
        f"{LOGS}/shards.log",
    benchmark:
        f"{BENCH}/shards.tsv"
    shell:
        "nanoeuler tokenize --params {params.cfg:q} --tokenizer {input.tok:q} "
        "--train {input.train:q} --val {input.val:q} --out {output:q} --workers {threads} > {log:q} 2>&1"
