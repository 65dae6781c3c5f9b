# rules for the data stages: download and clean books, web text and instruction data, then mix the corpus.
# Each download stage keeps its raw files in data/<stage>/raw/ (not a declared output, so a re-run after
# a parameter change reuses them instead of downloading again). Local sources (the tiny config's sample
# files) are rule inputs, so editing them re-runs the stage; relative ones are taken from the repository root.
from nanoeuler.data import alpaca as _alpaca
from nanoeuler.data import fineweb as _fineweb
from nanoeuler.data import gutenberg as _gutenberg
from nanoeuler.data import hellaswag as _hellaswag
from nanoeuler.data.common import local_sources


rule gutenberg:
    input:
        local_sources(_gutenberg.sources(config["gutenberg"]), workflow.basedir),
    output:
        "data/gutenberg/books.parquet",
    params:
        cfg=stage_params("gutenberg"),
        raw="data/gutenberg/raw",
        root=lambda wildcards: workflow.basedir,  # resolves relative sample paths; not a file prefix
    log:
        "logs/gutenberg.log",
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
        root=lambda wildcards: workflow.basedir,  # resolves relative sample paths; not a file prefix
    log:
        "logs/fineweb.log",
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
        root=lambda wildcards: workflow.basedir,  # resolves relative sample paths; not a file prefix
    log:
        "logs/alpaca.log",
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
        root=lambda wildcards: workflow.basedir,  # resolves relative sample paths; not a file prefix
    log:
        "logs/hellaswag.log",
    shell:
        "nanoeuler hellaswag --params {params.cfg:q} --raw-dir {params.raw:q} "
        "--source-root {params.root:q} --out {output:q} > {log:q} 2>&1"
