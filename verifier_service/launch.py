"""The verifier's entry point: tcmalloc, or glibc with its thresholds raised, first (speclane/allocator.py),
then torch."""

from speclane.allocator import reexecute_with_tcmalloc


def main(argv: list[str] | None = None, prog: str = "python -m verifier_service") -> None:
    reexecute_with_tcmalloc(glibc_thresholds=True)
    from verifier_service.server import main as serve

    serve(argv, prog)
