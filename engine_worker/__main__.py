from engine_worker.cli import main

main(prog_name="python -m engine_worker")
