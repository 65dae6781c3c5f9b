# nanoeuler: raw downloads -> tokenizer -> shards -> base model -> chat model -> evaluation.
#   snakemake --cores 12 results/chat.bin                               full run (GPU, network)
#   snakemake results/chat.bin --cores 2 --configfile config/tiny.yaml  offline smoke run (CPU);
#   name targets before --configfile, which takes several files
# Rules are thin: each calls the `nanoeuler` CLI, passing only the config sections its stage
# depends on (`--params`), so changing a section re-runs exactly the stages that read it.
import os

import yaml

from nanoeuler.config import params_json, validate

if not config:  # no --configfile given: the full run
    with open(os.path.join(workflow.basedir, "config", "config.yaml")) as f:
        config.update(yaml.safe_load(f) or {})
config.update(validate(config))


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
include: "workflow/rules/dpo.smk"
include: "workflow/rules/eval.smk"
