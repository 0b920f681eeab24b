# Installs specached's system files (run by `cmake --install` through install(SCRIPT); the
# variables SPECACHE_* are set just before it). Paths are decided here, at install time:
#   unit      <prefix>/lib/systemd/system/specached.service
#   sysusers  <prefix>/lib/sysusers.d/specache.conf
#   tmpfiles  <prefix>/lib/tmpfiles.d/specache.conf
#   config    <etc>/specache/specached.toml, <etc> = /etc for the prefix /usr, else <prefix>/etc
# The unit in deploy/ names /usr/bin/specached and /etc/specache/; the installed copy names where
# this install put them, so that the unit always runs the binary and config installed with it.
set(prefix "${CMAKE_INSTALL_PREFIX}")
if(prefix STREQUAL "/usr")
  set(etc "/etc")
else()
  set(etc "${prefix}/etc")
endif()

# The rewritten files are written here first; one directory per destination, so that two installs
# at once (the install and package tests) do not share one.
string(MD5 destination_key "$ENV{DESTDIR}${prefix}")
set(staging "${SPECACHE_STAGING_DIR}/${destination_key}")

function(specache_install_rewritten source destination name)
  file(READ "${SPECACHE_SOURCE_DIR}/${source}" text)
  string(REPLACE "/usr/bin/specached" "${prefix}/${SPECACHE_BINDIR}/specached" text "${text}")
  string(REPLACE "/etc/specache" "${etc}/specache" text "${text}")
  string(REPLACE "file:///usr/share/doc/specache" "file://${prefix}/${SPECACHE_DOCDIR}" text "${text}")
  file(WRITE "${staging}/${name}" "${text}")
  file(INSTALL DESTINATION "${destination}" TYPE FILE PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ
       FILES "${staging}/${name}")
endfunction()

file(MAKE_DIRECTORY "${staging}")
specache_install_rewritten(deploy/specached.service "${prefix}/lib/systemd/system" specached.service)
specache_install_rewritten(deploy/specache.tmpfiles "${prefix}/lib/tmpfiles.d" specache.conf)
file(INSTALL DESTINATION "${prefix}/lib/sysusers.d" TYPE FILE RENAME specache.conf
     PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ FILES "${SPECACHE_SOURCE_DIR}/deploy/specache.sysusers")
file(INSTALL DESTINATION "${etc}/specache" TYPE FILE PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ
     FILES "${SPECACHE_SOURCE_DIR}/deploy/specached.toml")
