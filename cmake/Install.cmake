# What `cmake --install` places, and the .deb `cpack -G DEB` builds from it (docs/operations.md):
#   bin/      specached, specachectl, specache-run, specache-bench and the service benchmarks
#   lib/      libspecache_client.so.0 (+ its private libspecache_proto.so.0), libspecache_agent.a,
#             libspecache_status.a, cmake/specache/ (find_package), pkgconfig/specache.pc
#   include/  specache/*.h: the agent's, the client's, status.h, host_mapping.h and the generated version.h
#   systemd   the unit, sysusers and tmpfiles entries, the default config (InstallSystemFiles.cmake)
include(CMakePackageConfigHelpers)

set(specache_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/specache)

# Libraries an engine links, exported as specache::client and specache::agent.
set_target_properties(specache_status PROPERTIES EXPORT_NAME status)
set_target_properties(specache_agent PROPERTIES EXPORT_NAME agent)
set(specache_exported specache_status specache_agent)
if(TARGET specache_client)
  # libspecache_proto.so, the generated gRPC code the client links privately, goes with it: the
  # consumer's linker needs to find it (no headers, no usage requirements).
  set_target_properties(specache_client PROPERTIES EXPORT_NAME client)
  set_target_properties(specache_proto PROPERTIES EXPORT_NAME proto_runtime)
  list(APPEND specache_exported specache_client specache_proto)
endif()
install(TARGETS ${specache_exported} EXPORT specacheTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/protocol/include/specache DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "status.h" PATTERN "host_mapping.h")
install(DIRECTORY ${PROJECT_SOURCE_DIR}/gpu_agent/include/specache DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${SPECACHE_GENERATED_INCLUDE_DIR}/specache/version.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/specache)
if(TARGET specache_client)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/client_lib/include/specache DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endif()

install(EXPORT specacheTargets NAMESPACE specache:: DESTINATION ${specache_cmake_dir})
set(SPECACHE_CONFIG_CUDA ${SPECACHE_HAVE_CUDA})
set(SPECACHE_CONFIG_OPENMP OFF)
if(OpenMP_CXX_FOUND)
  set(SPECACHE_CONFIG_OPENMP ON)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/specacheConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/specacheConfig.cmake INSTALL_DESTINATION ${specache_cmake_dir})
# 0.x: only the same minor version is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/specacheConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/specacheConfig.cmake ${PROJECT_BINARY_DIR}/specacheConfigVersion.cmake
        DESTINATION ${specache_cmake_dir})

# pkg-config: relocatable (the prefix is found from the .pc file's own directory).
file(RELATIVE_PATH SPECACHE_PC_PREFIX_FROM_PCDIR /${CMAKE_INSTALL_LIBDIR}/pkgconfig /)
string(REGEX REPLACE "/$" "" SPECACHE_PC_PREFIX_FROM_PCDIR "${SPECACHE_PC_PREFIX_FROM_PCDIR}")
set(SPECACHE_PC_AGENT_LIBS "-pthread")
if(OpenMP_CXX_FOUND)
  string(APPEND SPECACHE_PC_AGENT_LIBS " ${OpenMP_CXX_FLAGS}")
endif()
if(SPECACHE_HAVE_CUDA)
  string(APPEND SPECACHE_PC_AGENT_LIBS " -L${CUDAToolkit_LIBRARY_DIR} -lcudart")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/specache.pc.in ${PROJECT_BINARY_DIR}/specache.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/specache.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# Programs. They find the installed shared libraries relative to themselves (any prefix).
foreach(program specached specachectl specache-run specache-bench specache-spill-bench specache-service-bench
                specache-remote-bench)
  if(TARGET ${program})
    set_target_properties(${program} PROPERTIES INSTALL_RPATH "${SPECACHE_INSTALL_RPATH_BIN}")
    install(TARGETS ${program} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  endif()
endforeach()
foreach(library specache_client specache_proto)
  if(TARGET ${library})
    set_target_properties(${library} PROPERTIES INSTALL_RPATH "${SPECACHE_INSTALL_RPATH_LIB}")
  endif()
endforeach()

install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR})

# The daemon's system files, at the paths the installed unit names (decided at install time,
# since `cmake --install --prefix P` may differ from the configured prefix).
if(TARGET specached)
  install(CODE "set(SPECACHE_SOURCE_DIR \"${PROJECT_SOURCE_DIR}\")
set(SPECACHE_BINDIR \"${CMAKE_INSTALL_BINDIR}\")
set(SPECACHE_DOCDIR \"${CMAKE_INSTALL_DOCDIR}\")
set(SPECACHE_STAGING_DIR \"${PROJECT_BINARY_DIR}/install-staging\")")
  install(SCRIPT ${PROJECT_SOURCE_DIR}/cmake/InstallSystemFiles.cmake)
endif()

# cpack -G DEB: one package, prefix /usr, system files in /etc and /usr/lib (CPACK_SET_DESTDIR
# makes the install prefix /usr, so /etc is chosen as for any /usr install).
set(CPACK_PACKAGE_NAME specache)
set(CPACK_PACKAGE_VENDOR "specache")
set(CPACK_PACKAGE_CONTACT "specache maintainers <specache@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "KV-memory service for long-context LLM inference (specached, client library, GPU agent)")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_INSTALL_PREFIX /usr)  # the prefix the install runs with under CPACK_SET_DESTDIR
set(CPACK_SET_DESTDIR ON)
set(CPACK_STRIP_FILES ON)       # no debug info in the package (RelWithDebInfo builds carry ~100 MB)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION misc)
# Debian dependencies from the binaries' libraries. The CUDA runtime of a CUDA build comes from
# NVIDIA's installer, which registers no Debian package: it is left out of Depends.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "systemd")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA ${PROJECT_SOURCE_DIR}/deploy/debian/postinst
                                       ${PROJECT_SOURCE_DIR}/deploy/debian/conffiles)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)
