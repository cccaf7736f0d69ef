from services.gateway.service import main

main()
