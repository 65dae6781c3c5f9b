# nanoeuler: raw downloads -> tokenizer -> shards -> base model -> chat model -> evaluation.
#   snakemake --cores 12                                                full run (GPU, network): rule all
#   snakemake --report report.html                                      its report (the same --configfile)
#   snakemake results/chat.bin --cores 2 --configfile config/tiny.yaml  offline smoke run (CPU);
#   name targets before --configfile, which takes several files
# Rules are thin: each calls the `nanoeuler` CLI, passing only the config sections its stage
# depends on (`--params`), so changing a section re-runs exactly the stages that read it.
import json
import os
import sys

import yaml

from nanoeuler.config import validate
from nanoeuler.data.common import failure_causes
from nanoeuler.eval.compare import experiment_dirs

# Every rule runs `nanoeuler`: the one installed beside this Snakemake when there is one, from the same
# environment as the imports above (so `.venv/bin/snakemake` works without the venv activated), else PATH's.
_beside = os.path.dirname(sys.executable)
if os.access(os.path.join(_beside, "nanoeuler"), os.X_OK):
    os.environ["PATH"] = os.pathsep.join([_beside, os.environ.get("PATH", "")])

if not config:  # no --configfile given: the full run
    with open(os.path.join(workflow.basedir, "config", "config.yaml")) as f:
        config.update(yaml.safe_load(f) or {})
config.update(validate(config))

# Where this run's outputs and logs go: results/ and logs/, or results/<experiment>/ and logs/<experiment>/
# when the config names an experiment. Every rule builds its paths from these two prefixes; data/ (downloads
# and the cleaned corpora) is shared by all experiments.
RESULTS, LOGS = experiment_dirs(config["experiment"])
BENCH = LOGS.replace("logs", "benchmarks", 1)  # each rule's wall time and peak memory (`benchmark:`)
# The models that HellaSwag scores and `evaluate` reports; a stage that adds a model file appends its name.
EVAL_MODELS = ["base", "chat"]
# What a compute job asks a scheduler for (workflow/profiles/slurm/); locally, threads are capped at --cores.
RES = config["resources"]


onerror:
    # Snakemake names each failed rule and its log; the cause is that log's last line (`nanoeuler <stage>:
    # error: ...`, or the shell's `command not found`), so repeat it here, where the console ends.
    for line in failure_causes(log):  # `log`: Snakemake's own log, which names the failed jobs' logs
        print(line, file=sys.stderr)


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/tokenizer.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/dpo.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/release.smk"

# Downloads need the network, which cluster compute nodes often lack; the report rules are quick.
localrules: gutenberg, fineweb, alpaca, hellaswag, report_pages, compare

report: "workflow/report/workflow.rst"


# The default target (`snakemake` with no target; it must be a rule of this file, not of an included
# one): the full run's final outputs and the pages of its report (snakemake --report report.html).
rule all:
    default_target: True
    input:
        f"{RESULTS}/chat.bin",
        f"{RESULTS}/samples.md",
        f"{RESULTS}/metrics.json",
        f"{RESULTS}/loss.png",
        rules.report_pages.output,
        rules.compare.output if config["compare"]["experiments"] else [],
