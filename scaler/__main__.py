from scaler.cli import main

main()
