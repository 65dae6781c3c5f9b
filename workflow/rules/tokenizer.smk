# rules for the tokenizer stages: learn BPE merges on the training corpus, then encode both splits to shards.


rule tokenizer:
    input:
        "data/corpus/train.parquet",
    output:
        tok="results/tokenizer.json",
        hf="results/tokenizer.hf.json",
    params:
        cfg=stage_params("tokenizer"),
    log:
        "logs/tokenizer.log",
    benchmark:
        "benchmarks/tokenizer.tsv"
    shell:
        "nanoeuler tokenizer --params {params.cfg:q} --corpus {input:q} "
        "--out {output.tok:q} --hf-out {output.hf:q} > {log:q} 2>&1"


rule shards:
    input:
        tok="results/tokenizer.json",
        train="data/corpus/train.parquet",
        val="data/corpus/val.parquet",
    output:
        "results/shards/manifest.json",
    params:
        cfg=stage_params("shards"),
    threads: 64  # capped at --cores by Snakemake
    log:
        "logs/shards.log",
    benchmark:
        "benchmarks/shards.tsv"
    shell:
        "nanoeuler tokenize --params {params.cfg:q} --tokenizer {input.tok:q} "
        "--train {input.train:q} --val {input.val:q} --out {output:q} --workers {threads} > {log:q} 2>&1"
