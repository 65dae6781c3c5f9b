# rules for the data stages: download and clean books, web text and instruction data, then mix the corpus.
# Each download stage keeps its raw files in data/<stage>/raw/ (not a declared output, so a re-run after
# a parameter change reuses them instead of downloading again). Local sources (the tiny config's sample
# files) are rule inputs, so editing them re-runs the stage; relative ones are taken from the repository root.
from nanoeuler.data import alpaca as _alpaca
from nanoeuler.data import fineweb as _fineweb
from nanoeuler.data import gutenberg as _gutenberg
from nanoeuler.data import hellaswag as _hellaswag
from nanoeuler.data.common import local_sources

# Where relative sample paths live: the repository root, relative to the working directory, so that
# moving or copying the project changes no parameter (and re-runs nothing).
source_root = lambda wildcards: os.path.relpath(workflow.basedir)


rule gutenberg:
    input:
        local_sources(_gutenberg.sources(config["gutenberg"]), workflow.basedir),
    output:
        "data/gutenberg/books.parquet",
    params:
        cfg=stage_params("gutenberg"),
        raw="data/gutenberg/raw",
        root=source_root,
    log:
        "logs/gutenberg.log",
    benchmark:
        "benchmarks/gutenberg.tsv"
    shell:
        "nanoeuler gutenberg --params {params.cfg:q} --raw-dir {params.raw:q} "
        "--source-root {params.root:q} --out {output:q} > {log:q} 2>&1"


rule fineweb:
    input:
        local_sources(_fineweb.sources(config["fineweb"]), workflow.basedir),
    output:
        "data/web/web.parquet",
    params:
        cfg=stage_params("fineweb"),
        raw="data/web/raw",
        root=source_root,
    log:
        "logs/fineweb.log",
    benchmark:
        "benchmarks/fineweb.tsv"
    shell:
        "nanoeuler fineweb --params {params.cfg:q} --raw-dir {params.raw:q} "
        "--source-root {params.root:q} --out {output:q} > {log:q} 2>&1"


rule alpaca:
    input:
        local_sources(_alpaca.sources(config["alpaca"]), workflow.basedir),
    output:
        "data/alpaca/alpaca.jsonl",
    params:
        cfg=stage_params("alpaca"),
        raw="data/alpaca/raw",
        root=source_root,
    log:
        "logs/alpaca.log",
    benchmark:
        "benchmarks/alpaca.tsv"
    shell:
        "nanoeuler alpaca --params {params.cfg:q} --raw-dir {params.raw:q} "
        "--source-root {params.root:q} --out {output:q} > {log:q} 2>&1"


rule corpus:
    input:
        books="data/gutenberg/books.parquet",
        web="data/web/web.parquet",
    output:
        train="data/corpus/train.parquet",
        val="data/corpus/val.parquet",
    params:
        cfg=stage_params("corpus"),
    resources:
        **job_resources(),
    log:
        "logs/corpus.log",
    benchmark:
        "benchmarks/corpus.tsv"
    shell:
        "nanoeuler corpus --params {params.cfg:q} --books {input.books:q} --web {input.web:q} "
        "--train {output.train:q} --val {output.val:q} > {log:q} 2>&1"


rule hellaswag:
    input:
        local_sources(_hellaswag.sources(config["hellaswag"]), workflow.basedir),
    output:
        "data/hellaswag/hellaswag.jsonl",
    params:
        cfg=stage_params("hellaswag"),
        raw="data/hellaswag/raw",
        root=source_root,
    log:
        "logs/hellaswag.log",
    benchmark:
        "benchmarks/hellaswag.tsv"
    shell:
        "nanoeuler hellaswag --params {params.cfg:q} --raw-dir {params.raw:q} "
        "--source-root {params.root:q} --out {output:q} > {log:q} 2>&1"
