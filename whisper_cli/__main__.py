from whisper_cli.cli import main

main()
