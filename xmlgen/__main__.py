from xmlgen.cli import main

main()
