from cachemgr.cli import main

if __name__ == "__main__":  # not when multiprocessing workers import it
    main()
