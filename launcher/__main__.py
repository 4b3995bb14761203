from launcher.cli import main

main(prog_name="exl3-sidecar")
