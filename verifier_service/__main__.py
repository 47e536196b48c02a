from verifier_service.launch import main

main()
