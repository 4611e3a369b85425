"""``python -m spmd demo [--ranks N] [--steps N] [--size N] [--backend threads|gloo] [--seed N] (--help)``."""
import sys

USAGE = ("usage: python -m spmd demo [--ranks N] [--steps N] [--size N] "
         "[--backend threads|gloo] [--seed N] (--help)\n\n"
         "demo: train a domain-parallel CNN on heat diffusion beside one device; "
         "python -m spmd demo --help for its options")


def _main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help"):
        print(USAGE)
        return 0
    if len(sys.argv) < 2 or sys.argv[1] != "demo":
        print(USAGE, file=sys.stderr)
        return 2
    from .demo.cli import main
    return main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(_main())
