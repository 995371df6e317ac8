"""`python -m report --cache ... [--run ...]`: the entry point of `make report`."""
from octfm import cli
from report.page import main

if __name__ == "__main__":
    cli.run(main)
