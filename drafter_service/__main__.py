from drafter_service.server import main

main()
