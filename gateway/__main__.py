from gateway.server import main

main()
