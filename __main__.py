from kvf.cli.entry import main

main()
