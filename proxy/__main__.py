from proxy.cli import main

main(prog_name="python -m proxy")
