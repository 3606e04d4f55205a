from mars.cli import main

main(["stack", *__import__("sys").argv[1:]])
