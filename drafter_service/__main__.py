import sys
from speclane.cli import main

main(["drafter", *sys.argv[1:]])
