from dist_kernel.node.agent import main

main()
