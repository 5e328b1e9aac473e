if __name__ == "__main__":  # not when multiprocessing workers import it (they need none of the CLI)
    from cachemgr.cli import main

    main()
