"""`python -m rmsft_cli ...` (torchrun runs the learner's ranks this way): the `rmsft` command."""

if __name__ == "__main__":  # importing the module (tests/test_wheel.py imports every module) runs nothing
    from rmsft_cli.app import main

    main()
