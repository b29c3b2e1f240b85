"""`python -m rollout_svc --model DIR ...` (same flags as `rmsft serve`)."""

if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    from rollout_svc.server import main

    main()
