"""`python -m deltaserve`: the deltaserve command."""

from deltaserve.cli import main

main()
