from mars_state.service import main

main()
