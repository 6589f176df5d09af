from segcli.cli import main

main()
