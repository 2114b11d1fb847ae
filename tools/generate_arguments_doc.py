"""Write docs/arguments.md: every command-line option with its default and class (implemented, performance-only,
not available), generated from megatron/training/arguments/registry.py.

    python tools/generate_arguments_doc.py            # writes docs/arguments.md
    python tools/generate_arguments_doc.py --check    # exit 1 if docs/arguments.md is out of date
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron.training.arguments.arguments_doc import arguments_markdown  # noqa: E402

DOC = os.path.join(REPO, "docs", "arguments.md")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="Only check that docs/arguments.md is up to date.")
    args = parser.parse_args(argv)
    text = arguments_markdown()
    if args.check:
        with open(DOC) as f:
            if f.read() != text:
                print("docs/arguments.md is out of date: run python tools/generate_arguments_doc.py", file=sys.stderr)
                return 1
        return 0
    with open(DOC, "w") as f:
        f.write(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
