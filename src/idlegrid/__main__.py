from idlegrid.cli.main import main

main()
