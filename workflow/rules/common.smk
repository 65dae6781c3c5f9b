# helpers shared by the rule files (kept apart from the rules, as `snakemake --lint` asks).
from nanoeuler.config import params_json


def stage_params(*sections):
    """The --params JSON for a stage that reads these config sections.

    Returned as a function of the wildcards: Snakemake formats plain string params as patterns,
    and the JSON's braces (or a value such as a URL template's {id}) would be read as wildcards.
    """
    text = params_json(config, *sections)
    return lambda wildcards: text


def job_resources(gpu=False, count=1):
    """The resources of a compute rule: memory and run time from the config, and `count` GPUs for GPU
    jobs (a training stage's `gpus`: its data-parallel processes)."""
    kind = "gpu" if gpu else "cpu"
    return {"gpu": count if gpu else 0, "mem_mb": RES[f"{kind}_mem_mb"], "runtime": RES[f"{kind}_runtime_min"]}
