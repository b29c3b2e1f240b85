"""`python -m rmsft.cli ...` (torchrun runs the learner's ranks this way): the `rmsft` command."""

from rmsft.cli.app import main

main()
