"""``python -m spoolctl``: the CLI of this interpreter's environment (the same as the
``spoolctl`` script), for when that script is not on ``PATH`` (e.g. vLLM's virtualenv)."""

from spoolctl.cli.entry import main

if __name__ == "__main__":
    main()
