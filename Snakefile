# nanoeuler: raw downloads -> tokenizer -> shards -> base model -> chat model -> evaluation.
#   snakemake --cores 12                                                full run (GPU, network): rule all
#   snakemake --report report.html                                      its report (the same --configfile)
#   snakemake results/chat.bin --cores 2 --configfile config/tiny.yaml  offline smoke run (CPU);
#   name targets before --configfile, which takes several files
# Rules are thin: each calls the `nanoeuler` CLI, passing only the config sections its stage
# depends on (`--params`), so changing a section re-runs exactly the stages that read it.
import json
import os

import yaml

from nanoeuler.config import params_json, validate
from nanoeuler.eval.compare import experiment_dirs

if not config:  # no --configfile given: the full run
    with open(os.path.join(workflow.basedir, "config", "config.yaml")) as f:
        config.update(yaml.safe_load(f) or {})
config.update(validate(config))

# Where this run's outputs and logs go: results/ and logs/, or results/<experiment>/ and logs/<experiment>/
# when the config names an experiment. Every rule builds its paths from these two prefixes; data/ (downloads
# and the cleaned corpora) is shared by all experiments.
RESULTS, LOGS = experiment_dirs(config["experiment"])
# The models that HellaSwag scores and `evaluate` reports; a stage that adds a model file appends its name.
EVAL_MODELS = ["base", "chat"]
# What a compute job asks a scheduler for (workflow/profiles/slurm/); locally, threads are capped at --cores.
RES = config["resources"]


def job_resources(gpu=False):
    """The resources of a compute rule: memory and run time from the config, and one GPU for GPU jobs."""
    kind = "gpu" if gpu else "cpu"
    return {"gpu": 1 if gpu else 0, "mem_mb": RES[f"{kind}_mem_mb"], "runtime": RES[f"{kind}_runtime_min"]}


def stage_params(*sections):
    """The --params JSON for a stage that reads these config sections.

    Returned as a function of the wildcards: Snakemake formats plain string params as patterns,
    and the JSON's braces (or a value such as a URL template's {id}) would be read as wildcards.
    """
    text = params_json(config, *sections)
    return lambda wildcards: text


include: "workflow/rules/data.smk"
include: "workflow/rules/tokenizer.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/eval.smk"

# Downloads need the network, which cluster compute nodes often lack; the report rules are quick.
localrules: gutenberg, fineweb, alpaca, hellaswag, report_pages, compare

report: "workflow/report/workflow.rst"


# The default target (it must be a rule of this file, not of an included one): the run's evaluation and
# the pages of its report (snakemake --report report.html).
rule all:
    default_target: True
    input:
        rules.report_pages.output,
        rules.compare.output if config["compare"]["experiments"] else [],
