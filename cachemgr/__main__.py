from cachemgr.cli import main

main()
