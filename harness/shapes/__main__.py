"""`python -m harness.shapes [--shape boilerplate] [--seed 1] [--tokens 16000]`: one session, printed.

Prints the workload's session as chat messages (JSON), its tool schemas and its questions, to
read what a shape looks like to the model. Its own module because it is the package's only
entry point; nothing imports it.

Dependency rules: the standard library, the registry (harness.shapes) and harness.shapes.session.
"""

from __future__ import annotations

import argparse
import json

from harness import shapes
from harness.shapes.session import DEFAULT_TOKENS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.shapes", description=shapes.__doc__.splitlines()[0])
    parser.add_argument("--shape", default="boilerplate", choices=shapes.SHAPES)
    parser.add_argument("--seed", type=int, default=shapes.TUNING_SEEDS[0])
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    args = parser.parse_args(argv)
    workload = shapes.make(args.shape, args.seed, args.tokens)
    print(json.dumps({"messages": workload.messages(), "tools": workload.tools,
                      "questions": [q.__dict__ for q in workload.questions]}, ensure_ascii=False, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
