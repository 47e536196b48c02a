from verifier_service.server import main

main()
