from idlegrid.cli import main

main()
