import sys
from speclane.cli import main

main(["verifier", *sys.argv[1:]])
