from kvf.cli.main import main

main()
