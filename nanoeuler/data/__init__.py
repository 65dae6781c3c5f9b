"""Data stages: download, clean and mix the raw text the model learns from.

    gutenberg.py  Project Gutenberg books -> data/gutenberg/books.parquet (license text stripped)
    fineweb.py    FineWeb-Edu parquet     -> data/web/web.parquet (DuckDB filter + byte-budget sample)
    alpaca.py     Alpaca instruction JSON -> data/alpaca/alpaca.jsonl (validated, deduplicated)
    corpus.py     books + web             -> data/corpus/{train,val}.parquet (weighted mix, hash split)

All downloads go through `download.fetch`, which caches raw files under `data/<stage>/raw/`.
`template.py` holds the Alpaca prompt, the text form of a record that SFT, DPO's pairs, chat and the
server share.
"""
