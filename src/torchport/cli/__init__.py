"""The ``torchport`` command line: a thin argparse layer over the library (see :mod:`torchport.cli.main`)."""
