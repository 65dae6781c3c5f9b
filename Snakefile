# nanoeuler: raw downloads -> tokenizer -> shards -> base model -> chat model -> evaluation.
#   snakemake --cores 12                                                full run (GPU, network): rule all
#   snakemake results/chat.bin --cores 2 --configfile config/tiny.yaml  offline smoke run (CPU);
#   name targets before --configfile, which takes several files
# Rules are thin: each calls the `nanoeuler` CLI, passing only the config sections its stage
# depends on (`--params`), so changing a section re-runs exactly the stages that read it.
import os
import sys
import time

import yaml

from nanoeuler.config import validate
from nanoeuler.data.common import failure_causes

_started = time.time()  # logs written since then belong to this run

if not config:  # no --configfile given: the full run
    with open(os.path.join(workflow.basedir, "config", "config.yaml")) as f:
        config.update(yaml.safe_load(f) or {})
config.update(validate(config))


# The default target (`snakemake` with no target): the full run's final outputs.
rule all:
    input:
        "results/chat.bin",
        "results/samples.md",
        "results/metrics.json",
        "results/loss.png",


onerror:
    # Snakemake names the failed rule and its log; the cause is that log's last line
    # (`nanoeuler <stage>: error: ...`), so repeat it here, where the console ends.
    for line in failure_causes("logs", _started):
        print(line, file=sys.stderr)


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/tokenizer.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/eval.smk"
