"""`snakemake --lint` of the workflow, failing only on findings that are not accepted below.

Snakemake's lint exits 1 on any finding, and three of its findings hold for this workflow by design, so
`make lint` runs it through this script: an accepted finding is counted, anything else fails the lint.

    python scripts/lint_workflow.py [snakemake executable]   # default: the one beside this Python
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# finding (the start of Snakemake's message) -> why it stays
ACCEPTED = {
    "Specify a conda environment or container for each rule.": (
        "every rule runs this package's own CLI, from the one environment that make or environment.yml installs"
    ),
    "Environment variable PATH used but not asserted with envvars directive": (
        "the Snakefile puts the nanoeuler beside its Snakemake first on PATH; PATH itself is always set"
    ),
    "Param run_dir is a prefix of input or output file but hardcoded": (
        "dpo's run directory results/dpo shares only its name's start with results/dpo.bin: a folder, not a prefix"
    ),
}


def findings(output: str) -> list[str]:
    """The messages of Snakemake's lint output, one per finding.

    >>> findings("Lints for rule a (line 3, x.smk):\\n    * Specify a conda environment or container for each rule.:\\n"
    ...          "      This way, the used software is documented.\\n")
    ['Specify a conda environment or container for each rule.']
    """
    return [m.group(1) for m in re.finditer(r"^\s+\* (.+?):?$", output, flags=re.M)]


def not_accepted(messages: list[str]) -> list[str]:
    """The findings that no entry of ACCEPTED covers.

    >>> not_accepted(["Environment variable PATH used but not asserted with envvars directive in line 22.",
    ...               "Mixed rules and functions in same snakefile."])
    ['Mixed rules and functions in same snakefile.']
    """
    return [m for m in messages if not any(m.startswith(a) for a in ACCEPTED)]


def main(argv: list[str]) -> int:
    snakemake = argv[0] if argv else str(Path(sys.executable).with_name("snakemake"))
    proc = subprocess.run(
        [snakemake, "--lint", "--configfile", "config/tiny.yaml"], cwd=ROOT, capture_output=True, text=True
    )
    output = proc.stdout + proc.stderr
    messages = findings(output)
    if proc.returncode != 0 and not messages:  # it failed before linting (a syntax error, a bad config)
        sys.stderr.write(output)
        print(f"lint_workflow: snakemake --lint failed with exit status {proc.returncode}", file=sys.stderr)
        return 1
    bad = not_accepted(messages)
    for message in bad:
        print(f"lint_workflow: {message}", file=sys.stderr)
    print(f"lint_workflow: {len(messages) - len(bad)} accepted findings, {len(bad)} others")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
