"""``python -m spmd demo [--ranks N] [--steps N] [--size N] [--backend threads|gloo] [--seed N] (--help)``."""
import sys


def _main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] != "demo":
        print("usage: python -m spmd demo [--ranks N] [--steps N] [--size N] [--backend threads|gloo] [--seed N] (--help)")
        return 2
    from .demo.cli import main
    return main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(_main())
