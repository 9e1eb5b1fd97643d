"""Moved to ``flowgrpo.planner.advice``; ``python -m flowgrpo.config.memory_advice`` still
prints docs/memory.md's tables."""

if __name__ == "__main__":
    from flowgrpo.planner.advice import main

    main()
