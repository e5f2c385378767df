from taskrunner.cli import main

main()
